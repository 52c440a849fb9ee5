"""The pictures: the live page and ``report --html``, drawn from the analysis (a layer above analyze and serve)."""
