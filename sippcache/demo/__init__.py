"""What `sippcache demo` and `sippcache warm` run, and the demo's model.

- `sippcache.demo.model`: gemma-3-270m, assembled once from its PyPI package
  into the user cache folder (`gemma_model_path()`).
- `sippcache.demo.run`: the demo: a long prompt, cold then warm (`run_demo()`).
- `sippcache.demo.warm`: prefill prompt files into a cache (`warm()`).

They return reports; the CLI (`sippcache.cli`) prints them. Everything here
that needs llama-cpp-python imports it through `require_llama`, so a missing
package is one `MissingDependency` naming the extra to install.
"""
