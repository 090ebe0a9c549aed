"""Use cases: the only users of the store. HTTP handlers, commands and background jobs call
these; the pure core (`gateway.context`) and the providers (`gateway.upstream`) are called
from here."""
