"""Measuring: the server's boundaries, the steps, the machine's noise; writes JSON that predict/ reads."""
