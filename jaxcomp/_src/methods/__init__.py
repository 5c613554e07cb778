"""Methods: the optax transforms users build (``transforms``: jc.compress and its family;
the papers' methods; the wrappers). Import exchanges, codecs and plumbing (and
``tools.wire``'s trace reader: QSVRG's bit count, DiLoCo's every-H scope)."""
