"""Before the COMPSs runtime starts: what ``hpoflow launch`` builds and checks. ``command`` (the
``runcompss`` / ``enqueue_compss`` argv, with every value checked or encoded against COMPSs's
re-splitting), ``batch`` (the site config ``enqueue_compss`` reads: queue system, account, qos, the
workers' default size), ``workers`` (whether a trial fits the workers ``runcompss`` will have here) and
``runtime_xml`` (``resources.xml`` / ``project.xml`` for a machine, and reading one).
"""
