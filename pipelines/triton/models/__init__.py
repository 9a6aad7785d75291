"""The real ``model.py`` files the bundled server serves in place of models it has no backend for
(pipelines/triton/stand_ins.py): copied verbatim, with the ``serving/`` package beside them.
"""
