"""Tools around a run: metrics files and throughput (MFU), plots, GPU defaults. The training core never imports
them."""

from jaxpar.tools import gpu, metrics, plot

__all__ = ["gpu", "metrics", "plot"]
