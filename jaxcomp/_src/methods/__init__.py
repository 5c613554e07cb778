"""Methods: the optax transforms users build (``transforms``: jc.compress and its family;
the papers' methods; the wrappers). Import exchanges, codecs and plumbing (QSVRG's bit
count and DiLoCo's every-H scope read ``plumbing.collective_trace``), never tools."""
