"""Tools around a run: metrics files and throughput (MFU), plots, GPU defaults, CPU host memory. The training
core never imports them."""

from jaxpar.tools import cpu, datasheets, gpu, metrics, plot

__all__ = ["cpu", "datasheets", "gpu", "metrics", "plot"]
