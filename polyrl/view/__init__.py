"""`polyrl view`: a read-only local web page over run directories (server.py, static/), from their files alone
(runs.py reads them; paths.py decides which files may be served). It imports no trainer or model code: a run written
by an older version opens, and the page starts without loading torch."""
