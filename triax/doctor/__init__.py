"""`triax doctor`: is this machine ready for a long run, and how fast is it."""
