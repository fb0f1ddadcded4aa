"""Each patch's tests, as a pull request to mlx-lm would carry them.

``<patch name>.py`` holds, per upstream test file, the test methods the
patch adds (``ADD``: classes named like upstream's ``TestCase`` classes, or
new ones) and the edits of upstream tests it changes (``EDIT``: exact
``(old, new)`` replacements: imports, assertions on internals the patch
replaces). ``tools.testedits`` writes them into the patch's diff.

The methods are written as they read in upstream's test file and run
there, under its imports (``mx``, the cache classes, ``self.model`` loaded
in ``setUpClass``): these modules import nothing else. Each test added
fails on the source before its patch and passes after it;
``check-patches`` checks both.
"""
