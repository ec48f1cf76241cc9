"""Tests of jaxpar/plan/ (today jaxpar/plan.py, plan_hlo.py and plan_memory.py), one file per module."""
