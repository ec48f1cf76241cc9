"""Tests of jaxpar/pruning/, one file per module."""
