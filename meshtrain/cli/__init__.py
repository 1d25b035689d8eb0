"""The ``meshtrain`` command line (:mod:`.main`) and the glue of its subcommands (:mod:`.plan`)."""
