"""Device and backend chosen at run time, process groups and collectives (tensor parallel), and pipeline stages
with the engine that overlaps them."""
