"""Tests of jaxpar/plan/, one file per module."""
