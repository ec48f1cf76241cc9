"""Tests of jaxpar/pipeline/, one file per module."""
