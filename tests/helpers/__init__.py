"""Code the tests share, one module per idea; a test imports what it needs from the module itself.

- models: tiny Raven, looped GPT-2 and tokenizer builders, Huginn's published shape, random token ids
- engine: the exit policies' formulas restated in numpy, the exit rule as a loop, a reference engine
- cli: running `exitbench` in this process or as a subprocess (with its peak memory), and the one-line error check
- cells: reading result cells, checking them against the schema, hand-made cells with known answers (and files
  of them with samples, for the report), copies of the committed baseline's cells
- browser: a page opened in headless Chromium: errors, decoded images, exit-map token counts, screenshots
- files: before/after listings of a directory, a checkpoint shard cut short
- paths: where the repository, its task folders, the committed baseline and the local GSM8K copy are
- strategies: Hypothesis strategies the property tests share (any JSON value)
- sweeps: the session's shared small sweep, and the options of the smallest sweep a CLI test runs

tests/ is on sys.path under pytest (rootdir conftest, prepend import mode), so `from helpers.models import …`.
"""
