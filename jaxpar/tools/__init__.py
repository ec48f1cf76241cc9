"""Tools around a run: metrics files and throughput (MFU), plots, GPU defaults. The training core never imports
them."""

from jaxpar.tools import datasheets, gpu, metrics, plot

__all__ = ["datasheets", "gpu", "metrics", "plot"]
