"""The ``unickpt`` command line (``unickpt ...`` or ``python -m unickpt ...``)."""
