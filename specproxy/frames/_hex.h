/* _hex.h: one hex digit's value, shared by the C extensions (chunk sizes, JSON \u escapes). */
#ifndef SPECPROXY_HEX_H
#define SPECPROXY_HEX_H

static inline int
hex_value(unsigned char c)
{
    if (c >= '0' && c <= '9')
        return c - '0';
    if (c >= 'a' && c <= 'f')
        return c - 'a' + 10;
    if (c >= 'A' && c <= 'F')
        return c - 'A' + 10;
    return -1;
}

#endif
