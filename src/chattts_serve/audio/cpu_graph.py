"""The audio stage (Decoder + Vocos) as one graph in another CPU runtime: ONNX Runtime or OpenVINO.

The graph holds every convolution and the Vocos head's projection (hidden states [G, S, hidden] ->
projection [G, 2S, n_fft + 2]); the spectrum and the inverse STFT stay in torch
(``vocos.spectrum_of_projection``, ``vocos.istft``), as the torch path computes them. Graphs are built
once per model and runtime (a trace of the torch modules; the weights are the loaded ones).

Rows are decoded as one batch of equal length: right-padded batches need the torch path's padding
masks (``audio.decode._padding_masked``), so the caller decodes ragged rows apart.
"""

from __future__ import annotations

import os
import tempfile
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

RUNTIMES = ("ort-fp32", "ov-fp32", "ov-bf16", "ov-int8")
_INSTALL = {"ort": "pip install 'chattts-serve[onnx]'", "ov": "pip install 'chattts-serve[openvino]'"}


def require(runtime: str) -> None:
    """Raise ValueError with the install hint when ``runtime``'s library is missing."""
    kind = runtime.split("-")[0]
    try:
        if kind == "ov":
            import openvino  # noqa: F401

            if runtime == "ov-int8":
                import nncf  # noqa: F401
        else:
            import onnx  # noqa: F401
            import onnxruntime  # noqa: F401
    except ImportError as exc:
        raise ValueError(f"audio dtype {runtime} needs {exc.name}: {_INSTALL[kind]}") from None


def graph_for(model: Any, runtime: str, cache_dir: str | os.PathLike | None = None) -> AudioGraph:
    """The model's graph in ``runtime``, built on first use (seconds) and kept with the model's Vocos
    module (so it goes when the model does). ``cache_dir``: OpenVINO graphs are read from there, or stored
    there once built (``audio.graph_cache``)."""
    graphs = model.vocos.__dict__.setdefault("_runtime_graphs", {})
    if runtime not in graphs:
        graphs[runtime] = AudioGraph(model, runtime, cache_dir=cache_dir)
    return graphs[runtime]


class _Convolutions(nn.Module):
    def __init__(self, model: Any) -> None:
        super().__init__()
        self.decoder, self.backbone, self.out = model.decoder, model.vocos.backbone, model.vocos.head.out

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.out(self.backbone(self.decoder(h.transpose(1, 2))))


def convert(model: Any) -> Any:
    """``_Convolutions`` of ``model`` as an OpenVINO model (fp32 weights; rows and steps dynamic)."""
    import openvino as ov

    net = _Convolutions(model).eval()
    example = torch.zeros(1, 8, model.config.gpt.hidden_size)
    with warnings.catch_warnings(), torch.inference_mode(False), torch.no_grad():
        warnings.simplefilter("ignore")  # its TorchScript trace's deprecation notices
        return ov.convert_model(net, example_input=example)


def compile_graph(graph: Any, precision: str, threads: int, extra: dict[str, Any] | None = None) -> Any:
    """``graph`` compiled by OpenVINO's CPU plugin computing in ``precision`` (f32, bf16) on one stream of
    ``threads``: a callable array [G, S, hidden] -> projection array [G, 2S, n_fft + 2]. ``extra``: more
    plugin properties."""
    from ..kernels import openvino

    config = {"INFERENCE_NUM_THREADS": threads, "NUM_STREAMS": 1, "PERFORMANCE_HINT": "LATENCY"}
    config["INFERENCE_PRECISION_HINT"] = precision
    request = openvino.compile_model(graph, {**config, **(extra or {})}).create_infer_request()
    return lambda x: request.infer({0: x})[0]


def _ov_graph(model: Any, runtime: str) -> Any:
    """``runtime``'s OpenVINO model of the convolutions, as built (not yet compiled)."""
    graph = convert(model)
    if runtime == "ov-int8":
        from .quantize import int8_graph

        graph = int8_graph(model, graph)
    return graph


class AudioGraph:
    """``decode(h)``: hidden states [G, S, hidden] fp32 -> waveform [G, 512 S - 256] fp32 (torch)."""

    def __init__(
        self, model: Any, runtime: str, threads: int | None = None, cache_dir: str | os.PathLike | None = None
    ) -> None:
        """``cache_dir``: an OpenVINO graph is read from there when it holds this checkpoint's, else built and
        stored there (``audio.graph_cache``); None: built every time."""
        if runtime not in RUNTIMES:
            raise ValueError(f"audio runtime must be one of {', '.join(RUNTIMES)}; got {runtime!r}")
        require(runtime)
        self.runtime, self.model = runtime, model
        threads = threads or torch.get_num_threads()
        if runtime.startswith("ov-"):
            from .graph_cache import cached_graph

            root = getattr(model, "root", None)
            graph = cached_graph(root, runtime, lambda: _ov_graph(model, runtime), cache_dir)
            precision = "f32" if runtime == "ov-fp32" else "bf16"
            if runtime == "ov-int8":
                from ..cpu import probe

                precision = "bf16" if probe().bf16 else "f32"  # what int8 leaves out
            self._run = compile_graph(graph, precision, threads)
        else:
            import onnxruntime as ort

            net, example = _Convolutions(model).eval(), torch.zeros(1, 8, model.config.gpt.hidden_size)
            with tempfile.TemporaryDirectory() as tmp:
                path = Path(tmp) / "audio.onnx"
                with warnings.catch_warnings(), torch.inference_mode(False), torch.no_grad():
                    warnings.simplefilter("ignore")  # the TorchScript exporter's deprecation notices
                    torch.onnx.export(
                        net,
                        (example,),
                        str(path),
                        input_names=["h"],
                        output_names=["x"],
                        dynamic_axes={"h": {0: "rows", 1: "steps"}, "x": {0: "rows", 1: "frames"}},
                        dynamo=False,
                        opset_version=17,
                    )
                so = ort.SessionOptions()
                so.intra_op_num_threads, so.inter_op_num_threads = threads, 1
                so.log_severity_level = 3
                sess = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
            self._run = lambda x: sess.run(None, {"h": x})[0]

    @torch.inference_mode()
    def decode(self, h: torch.Tensor) -> torch.Tensor:
        from ..models.chattts.vocos import istft, spectrum_of_projection

        x = torch.from_numpy(np.asarray(self._run(np.ascontiguousarray(h.float().numpy()))))
        head = self.model.vocos.head
        spec = spectrum_of_projection(x)
        return istft(spec, head.istft.window, head.envelope(spec.shape[2]))
