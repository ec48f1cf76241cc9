"""Tests of jaxpar/cli/ (today jaxpar/run.py and jaxpar/launch.py), one file per module."""
