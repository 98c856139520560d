"""The ecosystem: MLflow tracking and models, provenance, sentence-transformers export."""
