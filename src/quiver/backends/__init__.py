"""One module per framework. Each exposes a :class:`~quiver.backends.base.Backend`."""
