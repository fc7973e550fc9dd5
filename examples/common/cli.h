/* Command-line flags for the training programs: a table of --name VALUE
 * options (also --name=VALUE; booleans take no value), a usage text made
 * from the table, and errors that name the flag. */
#ifndef NABLA_EXAMPLES_CLI_H
#define NABLA_EXAMPLES_CLI_H

#include <stdbool.h>
#include <stdint.h>

/* CLI_OPTIONAL: a string whose value may be left out ("--resume" or
 * "--resume auto"): the next argument is its value unless it starts with
 * "--"; left out, the value is "". */
typedef enum cli_type { CLI_INT, CLI_DOUBLE, CLI_STRING, CLI_BOOL, CLI_OPTIONAL } cli_type;

typedef struct cli_flag {
    const char *name; /* without the dashes */
    cli_type type;
    void *value;      /* int64_t *, double *, const char ** (also CLI_OPTIONAL), bool * */
    const char *help; /* the default is appended from *value */
} cli_flag;

/* Parses argv against the table. Returns 0 when the program should go on,
 * 1 after printing the usage for --help or nb_config_string() for --info
 * (exit 0), 2 after printing an error
 * and the usage hint to stderr (exit 2). */
int cli_parse(int argc, char **argv, const char *program, const char *summary,
              const cli_flag *flags, int n_flags);

/* True when the flag was given on the command line (after cli_parse). */
bool cli_given(const cli_flag *flags, int n_flags, const char *name);

#endif
