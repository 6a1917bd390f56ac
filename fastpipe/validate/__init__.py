"""Layer 1 rules: everything fastpipe checks before any weight data is read.

    validate_structure(p)        # pure data: roles, devices, comm groups, order, metadata
    validate(p, opts, store)     # + payloads (decoded, fake-propagated) + param-file headers

Both raise the first error found (a FastpipeError naming its JSON path).

Two layers, in separate modules:

- pure data (rules.py, with structure.py, comm_groups.py, dataflow.py, order.py and
  metadata.py): reads the Pipeline only; imports no payload, weights, comm, runtime,
  lower or CLI code;
- files (files.py, with payloads.py and sources.py): reads payload side files, decodes
  payloads (torch), and reads param-file headers through the weight store.

``import fastpipe.validate`` loads only the first; validate() and check_params() import
the second when called. tests/test_layering.py checks both statements.
"""
from __future__ import annotations

from fastpipe.format.model import Pipeline
from fastpipe.options import LoadOptions
from fastpipe.validate.comm_groups import CommGroup
from fastpipe.validate.rules import Checked, validate_structure


def validate(p: Pipeline, opts: LoadOptions | None = None, store=None) -> Checked:
    """validate_structure(p), then the file-level checks: every payload decoded and checked
    against its supertask (if opts.check_payloads), every param file's header (store: a
    WeightStore, default the process-wide one). See fastpipe.validate.files."""
    from fastpipe.validate.files import validate as _validate

    return _validate(p, opts, store)


def check_params(p: Pipeline, opts: LoadOptions, store) -> None:
    """Every constant's param file: confined and header-checked (fastpipe.validate.files)."""
    from fastpipe.validate.files import check_params as _check_params

    _check_params(p, opts, store)


__all__ = ["Checked", "CommGroup", "LoadOptions", "check_params", "validate", "validate_structure"]
