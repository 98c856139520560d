"""The pyfunc model as MLflow's "models from code": logged as source (this file) and run at load
time, so nothing is pickled (qrag.integrations.mlflow_model.RetrieverModel loads the checkpoint artifact)."""

from mlflow.models import set_model

from qrag.integrations.mlflow_model import RetrieverModel

set_model(RetrieverModel())
