"""Built-in example pipelines: ``yolov5`` (letterbox -> detector -> NMS), and
``basic`` (a chain and a diamond, for tests and benchmarks)."""
