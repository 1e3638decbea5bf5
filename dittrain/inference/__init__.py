"""A trained run, opened and used: sampling, evaluation samples, serving, exports.

    open_run.py      opening a run: weights, config, store, autoencoder, text encoder
    weights.py       reading weights (runs, exports, official DiT files), --init-from
    sample.py        `dittrain sample`: plans, the sampling loop, grids and PNGs, a bucketed run's sizes
    route_guidance.py  `dittrain sample --route-guidance`: TREAD's guidance by two routed passes
    eval_samples.py  `dittrain sample --npz`: the ADM evaluator's file in resumable chunks
    serve.py         `dittrain serve`: the local web page
    export.py        `dittrain export`: diffusers, fp16, int8 (and ONNX through onnx.py)
    onnx.py          the forward as an ONNX file, checked, and sampled through onnxruntime

The package itself imports nothing.
"""
