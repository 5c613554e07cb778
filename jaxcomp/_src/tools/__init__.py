"""Tools that read a transform from outside: where its state lives (``specs``), the
bytes it moves (``wire``), what they cost on a link (``network``). Import methods and
everything below."""
