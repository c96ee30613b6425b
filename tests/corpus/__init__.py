"""The acceptance corpus: public training programs run unchanged as trials (docs/corpus.md)."""
