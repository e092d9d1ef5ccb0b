"""The rollout inspector: `RUN/inspect.html`, one self-contained page (its script, styles and data inline; nothing
fetched) that shows what a run trained on, token by token, from its rollout record (rl_tpu/controller/recording.py).

`data` turns a run folder into the page's data (capped); `page` puts the data into the page's template, the package
files `page.html`, `page.css` and `page.js` (read with importlib.resources; pyproject's package-data ships them).
`python -m rl_tpu.report RUN` and `rl-tpu inspect RUN` write it. What the page shows: docs/outputs.md.
"""

from rl_tpu.outputs.inspect.page import write_page

__all__ = ["write_page"]
