"""PaddlePaddle kernels for the worker engine. Imports only paddle and numpy.

Only ops that exist in Paddle 2.6 and 3.x are used (matmul, softmax, embedding, index_select,
scatter_, split, reshape, transpose, concat), so one code path runs on the CPU wheel and on
paddlepaddle-gpu. Import ``splitbus.gpu_ops.device`` and call ``prepare`` before the first
``import paddle`` of the process.
"""
