"""Ensembles: the DAG plan (pure) and the data-flow scheduler."""
