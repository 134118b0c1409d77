"""alpsck under other frameworks' own checkpoint hooks, each in its module (imported only by whoever uses it, since
each imports its framework): :mod:`alpsck.integrations.lightning`."""
