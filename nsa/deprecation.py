"""This toolkit's own spellings from before its first release (``--json PATH``, short flags that meant
something else, config keys that moved out of ``train``): read, with one warning each, until
:data:`PRE_RELEASE_UNTIL`. ``tests/test_deprecation.py`` fails once that date has passed, so they are removed
then. (The older system's inputs, which the runbooks need, are not dated: ``nsa.config.legacy``.)"""

from __future__ import annotations

import datetime

PRE_RELEASE_UNTIL = datetime.date(2027, 3, 1)
READ_UNTIL = f"read until {PRE_RELEASE_UNTIL.isoformat()}"
