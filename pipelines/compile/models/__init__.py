"""The real ``model.py`` files copied verbatim into compiled repositories, with the ``serving/`` package:
the step adapter, the BLS executor, the ensemble's failure gate and the fused model; each reads its JSON plan.
"""
