"""Built-in example pipelines: ``yolov5`` (letterbox -> detector -> NMS -> scale_boxes),
``basic`` (chain, diamond), ``text`` (BYTES/BOOL/INT64), ``failing_branch`` (benchmarks)."""
