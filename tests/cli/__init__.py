"""Tests of jaxpar/cli/, one file per module."""
