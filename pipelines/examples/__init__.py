"""Built-in example pipelines: ``yolov5`` (letterbox -> detector -> NMS -> scale_boxes),
``basic`` (chain, diamond), ``text`` (BYTES/BOOL/INT64), ``boundaries`` and ``failing_branch`` (benchmarks)."""
