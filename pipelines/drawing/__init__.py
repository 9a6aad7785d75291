"""A pipeline drawn: the SVG/HTML diagram, and its mermaid and dot texts."""
