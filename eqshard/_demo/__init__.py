"""`eqshard demo`: an application beside the library (see README.md)."""
