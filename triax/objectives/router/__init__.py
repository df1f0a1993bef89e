"""A mixture of experts' router losses: a term added to whatever objective the run trains, and the
router's figures on the log line (term)."""
