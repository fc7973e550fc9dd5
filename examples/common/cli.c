/* Command-line flags for the training programs (see cli.h). Values are
 * parsed whole (strtoll, strtod with nothing left over), so "--steps 10x"
 * is an error, not 10. */
#include "cli.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "nabla/config.h"

#define MAX_FLAGS 128

static const cli_flag *given_table;
static bool given[MAX_FLAGS];

static void print_default(FILE *f, const cli_flag *fl) {
    switch (fl->type) {
    case CLI_INT: fprintf(f, " (default %lld)", (long long)*(int64_t *)fl->value); break;
    case CLI_DOUBLE: fprintf(f, " (default %g)", *(double *)fl->value); break;
    case CLI_STRING:
    case CLI_OPTIONAL: {
        const char *v = *(const char **)fl->value;
        if (!v) break;
        fputs(" (default \"", f);
        for (; *v; v++) {
            if (*v == '\n') fputs("\\n", f);
            else if (*v == '\t') fputs("\\t", f);
            else fputc(*v, f);
        }
        fputs("\")", f);
        break;
    }
    case CLI_BOOL: break;
    }
}

static void usage(FILE *f, const char *program, const char *summary, const cli_flag *flags, int n) {
    fprintf(f, "usage: %s [flags]\n%s\n\nflags:\n", program, summary);
    for (int i = 0; i < n; i++) {
        const char *arg = flags[i].type == CLI_INT ? " N" : flags[i].type == CLI_DOUBLE ? " X"
                          : flags[i].type == CLI_STRING ? " S" : flags[i].type == CLI_OPTIONAL ? " [S]" : "";
        int w = fprintf(f, "  --%s%s", flags[i].name, arg);
        fprintf(f, "%*s%s", w < 24 ? 24 - w : 1, "", flags[i].help);
        print_default(f, &flags[i]);
        fputc('\n', f);
    }
    fprintf(f, "  --info%*sprint which library, instruction set and threads each kind of "
               "product uses here, and exit\n", 24 - 8, "");
    fprintf(f, "  --help, -h%*sprint this and exit\n", 24 - 12, "");
}

static int set_value(const cli_flag *fl, const char *text, const char *program) {
    char *end;
    errno = 0;
    switch (fl->type) {
    case CLI_INT: {
        long long v = strtoll(text, &end, 10);
        if (errno || end == text || *end) break;
        *(int64_t *)fl->value = v;
        return 0;
    }
    case CLI_DOUBLE: {
        double v = strtod(text, &end);
        if (errno || end == text || *end) break;
        *(double *)fl->value = v;
        return 0;
    }
    case CLI_STRING:
    case CLI_OPTIONAL: *(const char **)fl->value = text; return 0;
    case CLI_BOOL: break;
    }
    fprintf(stderr, "%s: --%s: \"%s\" is not %s\n", program, fl->name, text,
            fl->type == CLI_INT ? "an integer" : "a number");
    return 2;
}

int cli_parse(int argc, char **argv, const char *program, const char *summary,
              const cli_flag *flags, int n_flags) {
    given_table = flags;
    memset(given, 0, sizeof given);
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            usage(stdout, program, summary, flags, n_flags);
            return 1;
        }
        if (!strcmp(a, "--info")) {
            fputs(nb_config_string(), stdout);
            return 1;
        }
        if (strncmp(a, "--", 2) != 0) {
            fprintf(stderr, "%s: unexpected argument \"%s\" (flags start with --; see --help)\n",
                    program, a);
            return 2;
        }
        const char *name = a + 2, *eq = strchr(name, '=');
        size_t len = eq ? (size_t)(eq - name) : strlen(name);
        int k = -1;
        for (int j = 0; j < n_flags && j < MAX_FLAGS; j++)
            if (strlen(flags[j].name) == len && !strncmp(flags[j].name, name, len)) k = j;
        if (k < 0) {
            fprintf(stderr, "%s: unknown flag \"--%.*s\" (see --help)\n", program, (int)len, name);
            return 2;
        }
        given[k] = true;
        if (flags[k].type == CLI_BOOL) {
            if (eq && strcmp(eq + 1, "1") && strcmp(eq + 1, "0") && strcmp(eq + 1, "true") &&
                strcmp(eq + 1, "false")) {
                fprintf(stderr, "%s: --%s takes no value, or =true / =false\n", program, flags[k].name);
                return 2;
            }
            *(bool *)flags[k].value = !eq || !strcmp(eq + 1, "1") || !strcmp(eq + 1, "true");
            continue;
        }
        const char *value = eq ? eq + 1 : NULL;
        if (!value && flags[k].type == CLI_OPTIONAL)
            value = i + 1 < argc && strncmp(argv[i + 1], "--", 2) != 0 ? argv[++i] : "";
        if (!value) {
            if (i + 1 >= argc) {
                fprintf(stderr, "%s: --%s needs a value\n", program, flags[k].name);
                return 2;
            }
            value = argv[++i];
        }
        int rc = set_value(&flags[k], value, program);
        if (rc) return rc;
    }
    return 0;
}

bool cli_given(const cli_flag *flags, int n_flags, const char *name) {
    if (flags != given_table) return false;
    for (int j = 0; j < n_flags && j < MAX_FLAGS; j++)
        if (!strcmp(flags[j].name, name)) return given[j];
    return false;
}
