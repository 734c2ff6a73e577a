"""Reading a compiled HLO module's text (`compiled.as_text()`): pure text, no JAX.

`_parse.parse` turns the text into computations of instructions, each with its
shape, opcode, operands (by name) and attributes, and a symbol table of every
instruction's shape, since compiled texts often print an operand by name only
(XLA:TPU's `all-reduce(%fusion)`). On that:

- `_collectives.collectives`: every collective with the bytes it moves on each
  device, its device groups (from every notation XLA writes them in:
  `_groups.device_groups`) and how many times one run of the program runs it;
- `_flops.flops`: the FLOPs of the matrix products one device runs (`dot`,
  `convolution`, cuBLAS and cuDNN calls);
- `_calls.runs`: how many times one run of the entry runs each computation: a
  `while` body its trip count (`_calls.trip_count`), a `conditional` only its
  heaviest branch, anything else once per call site.

What it does not know (a collective's name, a notation of device groups, a dtype,
a matrix-product call) is an `EqshardError` that names it and its line: a figure
is never a silent zero.
"""
