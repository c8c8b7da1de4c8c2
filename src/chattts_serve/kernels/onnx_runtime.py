"""ONNX Runtime for any model: the one check that it is installed, and the files of an exported graph (the
graph, its weights beside it). What a model exports and how it caches it is the family's
(``models.chattts.onnx_export``, ``models.chattts.onnx_cache``)."""

from __future__ import annotations

from pathlib import Path

WEIGHT_KINDS = ("fp32", "int8", "int4", "int4-b128")
MODEL_FILE = "model.onnx"
DATA_FILE = "model.onnx.data"
"""The weight kinds an export may hold: fp32, or quantised by ``kernels.onnx_quant``."""


def require_onnxruntime() -> None:
    """Raise ValueError with the install hint when ONNX Runtime (or onnx) is missing."""
    try:
        import onnx  # noqa: F401
        import onnxruntime  # noqa: F401
    except ImportError as exc:
        raise ValueError(
            f"the ort-* precisions need ONNX Runtime ({exc.name} is not installed): pip install 'chattts-serve[onnx]'"
        ) from None


def save_model(model, directory: Path) -> None:
    """Write an ``onnx.ModelProto`` as an export's graph and data files in ``directory``."""
    import onnx

    onnx.save_model(
        model,
        str(directory / MODEL_FILE),
        save_as_external_data=True,
        all_tensors_to_one_file=True,
        location=DATA_FILE,
        size_threshold=1024,
    )
