"""A named corpus of hand-made bad objects and notifications, and a mutator of good ones.

Compressed objects of every syntax the worker decodes have their own family
(``compressed_cases``: codestreams and encapsulated items broken in each way the
worker must survive, with what must come of each) and mutator
(``mutated_compressed``), and ``decode_as_worker`` decodes one in this process
the way the worker does.

Everything is deterministic and small (the biggest object is ~1.1 MiB, the
biggest notification 2 MiB). Each bad item names the dead-letter reason and
error type the worker must give it.

The modules, one a concern: ``bases`` (test settings, entry types, the valid bases),
``edits`` (byte surgery), ``native``, ``deflated`` and ``compressed`` (the bad objects
of each kind), ``corpus`` (all bad objects, and the good ones), ``notifications``,
``mutations`` (hypothesis strategies). This package re-exports what the tests use.
"""

from tests.bad_inputs.bases import (
    MAX_HEADER_BYTES,
    MIB,
    PART_SIZE,
    BadObject,
    ct_small,
    encapsulated_large,
    encapsulated_small,
    large_base,
    small_base,
)
from tests.bad_inputs.compressed import (
    ISOLATED_MUTATIONS,
    CompressedCase,
    compressed_bases,
    compressed_cases,
    decode_as_worker,
    pixel_array,
)
from tests.bad_inputs.corpus import bad_objects, good_objects
from tests.bad_inputs.deflated import (
    DEFLATED,
    deflate_file,
    deflated_cases,
    deflated_goods,
    meta_end,
    zeros,
)
from tests.bad_inputs.edits import (
    edit,
    fragment_at,
    insert_before_pixels,
    nested_sequences,
    padded,
    pixel_tag_at,
    private_ob,
    set_u32,
)
from tests.bad_inputs.mutations import (
    Mutant,
    compressed_mutations,
    mutate,
    mutated_compressed,
    mutations,
)
from tests.bad_inputs.notifications import (
    aws_records,
    bad_notifications,
    notification,
    skipped_notifications,
)

__all__ = [
    "DEFLATED",
    "ISOLATED_MUTATIONS",
    "MAX_HEADER_BYTES",
    "MIB",
    "PART_SIZE",
    "BadObject",
    "CompressedCase",
    "Mutant",
    "aws_records",
    "bad_notifications",
    "bad_objects",
    "compressed_bases",
    "compressed_cases",
    "compressed_mutations",
    "ct_small",
    "decode_as_worker",
    "deflate_file",
    "deflated_cases",
    "deflated_goods",
    "edit",
    "encapsulated_large",
    "encapsulated_small",
    "fragment_at",
    "good_objects",
    "insert_before_pixels",
    "large_base",
    "meta_end",
    "mutate",
    "mutated_compressed",
    "mutations",
    "nested_sequences",
    "notification",
    "padded",
    "pixel_array",
    "pixel_tag_at",
    "private_ob",
    "set_u32",
    "skipped_notifications",
    "small_base",
    "zeros",
]
