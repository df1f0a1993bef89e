"""`triax config`, `triax launch`, `triax env`: start the user's own script on many processes."""
