"""Tests of jaxpar/models/, one file per module."""
