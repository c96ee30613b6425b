"""Before the COMPSs runtime starts: what ``hpoflow launch`` builds. ``command`` (the ``runcompss`` /
``enqueue_compss`` argv, with every value checked or encoded against COMPSs's re-splitting), ``batch``
(the batch job's time and qos) and ``runtime_xml`` (``resources.xml`` / ``project.xml`` for a machine).
"""
