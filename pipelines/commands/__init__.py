"""What the command lines (pipelines.cli, bench, predict, calibrate) share: reading a pipeline and its inputs, writing outputs, interrupts, the machine's description."""
