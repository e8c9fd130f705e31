"""Testing helpers: the pytest plugin (``hangdoc.testing.plugin``) and collective-order checks."""
