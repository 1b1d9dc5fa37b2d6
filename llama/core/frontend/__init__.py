"""The engine and front end: the decode core's step loop, the engine thread, and what callers hand it (requests, sampling parameters, inputs, sessions, prefixes, text streams)."""
