"""The real ``model.py`` files copied verbatim into compiled repositories:
``step_model.py`` (the adapter that serves one step) and ``bls_model.py`` (the
BLS executor). Each reads its plan as JSON from its version directory.
"""
