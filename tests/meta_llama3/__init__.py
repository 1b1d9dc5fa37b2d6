"""Meta's own tests, vendored unchanged (see README.md); a package so their basenames cannot collide."""
